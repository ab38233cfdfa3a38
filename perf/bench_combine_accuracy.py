"""Accuracy and bytes of the combine wire formats: BF16, FP16, FP8 (e4m3, 1x128 scales) and LogFMT-10.

For each data set, expert outputs ``y[t, k]`` (16-bit, as an expert GEMM writes them) are combined as
``out[t] = sum_k w[t, k] * decode(encode(y[t, k]))`` in float32 and rounded once to the output dtype, exactly the
math of the kernels (``moe_ep.kernels.logfmt``'s torch codecs; tests/test_combine_formats.py checks the kernels
bitwise against it). The reference is the float32 sum of the same 16-bit ``y`` (no wire format, no final rounding).

Data sets (CPU is enough):

- ``dsv3-mlp``: a DeepSeek-V3 routed-expert layer: hidden 7168, expert intermediate 2048, top-8 of 16 random
  experts, random FP8 (1x128-quantized) W1/W3/W2, SwiGLU; tokens are RMS-normalised Gaussian rows;
- ``student-t3``: heavy-tailed synthetic activations, Student-t with 3 degrees of freedom, times log-normal
  per-channel scales (a few channels 10-100x larger: outlier channels);
- ``gaussian``: N(0, 1).

Metrics per format: relative Frobenius error ``|out - ref| / |ref|``, the 99.9th percentile and the max of the
per-element error divided by the row RMS of ``ref``, and the bytes one token moves in low-latency combine
(top-k rows of ``row_bytes``; DeepEP's counting is ``selections x 2H`` for BF16).

    python perf/bench_combine_accuracy.py [--tokens 256] [--json out.jsonl]
    python perf/bench_combine_accuracy.py --cpu-smoke     # tiny shapes
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402

_common.smoke_env()

import torch  # noqa: E402

from moe_ep.fp8 import per_token_group_quant_fp8_ref  # noqa: E402
from moe_ep.kernels.logfmt import FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT, decode_rows, encode_rows, row_bytes  # noqa: E402

PROG = "perf/bench_combine_accuracy.py"
FORMATS = [("BF16", FMT_BF16, torch.bfloat16), ("FP16", FMT_FP16, torch.float16),
           ("LogFMT-10", FMT_LOGFMT, torch.bfloat16), ("FP8 e4m3 1x128", FMT_FP8, torch.bfloat16)]


def _fp8_weight(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    w = torch.randn(rows, cols, generator=g) / cols ** 0.5
    q, s = per_token_group_quant_fp8_ref(w, 128)
    return (q.float().reshape(rows, cols // 128, 128) * s[:, :, None]).reshape(rows, cols)


def dsv3_mlp(n: int, hidden: int, inter: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    x = (x / x.pow(2).mean(1, keepdim=True).sqrt()).to(torch.bfloat16).float()
    scores = torch.randn(n, experts, generator=g).softmax(-1)
    w, idx = scores.topk(k, dim=1)
    w = w / w.sum(1, keepdim=True)
    y = torch.empty(n, k, hidden)
    for e in range(experts):  # weights made one expert at a time (memory)
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w1, w3, w2 = _fp8_weight(g, inter, hidden), _fp8_weight(g, inter, hidden), _fp8_weight(g, hidden, inter)
        xe = x[tok]
        h = torch.nn.functional.silu(xe @ w1.t()) * (xe @ w3.t())
        h = h.to(torch.bfloat16).float()  # the activation the down GEMM reads
        y[tok, slot] = h @ w2.t()
    return y, w.float()


def synthetic(n: int, hidden: int, k: int, seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        y = torch.randn(n, k, hidden, generator=g)
    else:
        chi2 = torch.distributions.Chi2(torch.tensor(3.0)).sample((n, k, hidden))
        y = torch.randn(n, k, hidden, generator=g) / (chi2 / 3).sqrt()
        y = y * torch.exp(torch.randn(hidden, generator=g) * 1.0)  # log-normal channel scales
    w = torch.rand(n, k, generator=g)
    return y, w / w.sum(1, keepdim=True)


def combine(y16: torch.Tensor, w: torch.Tensor, fmt: int, out_dtype: torch.dtype) -> torch.Tensor:
    n, k, h = y16.shape
    dec = decode_rows(encode_rows(y16.reshape(n * k, h), fmt), fmt, h).reshape(n, k, h)
    acc = torch.zeros(n, h)
    for j in range(k):
        acc += w[:, j:j + 1] * dec[:, j]
    return acc.to(out_dtype)


def main(argv=None) -> int:
    p = _common.parser(PROG, __doc__)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, tokens=8, hidden=512, inter=256, experts=4, topk=2)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rec = _common.Records("bench_combine_accuracy", args.json, args.cpu_smoke, device="CPU (numerics only)", argv=argv,
                          method=_common.COUNTED)
    H, K = args.hidden, args.topk
    sets = {"dsv3-mlp": lambda dt: dsv3_mlp(args.tokens, H, args.inter, args.experts, K, 1),
            "student-t3": lambda dt: synthetic(args.tokens, H, K, 2, "t"),
            "gaussian": lambda dt: synthetic(args.tokens, H, K, 3, "gaussian")}
    cols = ["data", "format", "rel. error (Frobenius)", "p99.9 err / row RMS", "max err / row RMS",
            "bytes / token (top-%d)" % K, "vs BF16"]
    print(_common.table_header(cols))
    bf16_bytes = K * row_bytes(FMT_BF16, H)
    for name, make in sets.items():
        y, w = make(None)
        for label, fmt, dt in FORMATS:
            y16 = y.to(dt)  # what the expert writes (the combine's x)
            ref = torch.zeros(y.shape[0], H)
            for j in range(K):
                ref += w[:, j:j + 1] * y16[:, j].float()
            out = combine(y16, w, fmt, dt).float()
            err = (out - ref).abs() / ref.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
            fro = float((out - ref).norm() / ref.norm())
            p999 = float(torch.quantile(err.flatten()[:1 << 22].double(), 0.999))
            nbytes = K * row_bytes(fmt, H)
            print(f"| {name} | {label} | {fro:.2e} | {p999:.2e} | {float(err.max()):.2e} | {nbytes} | "
                  f"{nbytes / bf16_bytes:.3f} |")
            rec.add(f"{name} {label}", "rel_err_fro", fro, "ratio", p999_row_rms=p999, max_row_rms=float(err.max()),
                    bytes_per_token=nbytes, bytes_vs_bf16=nbytes / bf16_bytes, hidden=H, topk=K, tokens=args.tokens,
                    valid=bool(torch.isfinite(out).all()))
    return rec.finish(PROG)


if __name__ == "__main__":
    sys.exit(main())
