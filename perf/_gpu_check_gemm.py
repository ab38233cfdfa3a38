"""GPU check of moe_ep.gemm's DeepGEMM surface (needs CUDA; not run by the test suite): psum vs m_indices bitwise,
padding, the SM cap, masked tiles with PDL, dense FP8 (+c, nn) and BF16, grouped BF16, with DeepGEMM's calc_diff
thresholds. ``python perf/_gpu_check_gemm.py`` prints one OK/FAIL line per check and exits 1 on a failure."""
# ruff: noqa: E401,E402,E501,E701,E702
import sys, torch
sys.path.insert(0, ".")
from moe_ep import gemm
from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_block_quant_fp8, per_token_group_quant_fp8

def calc_diff(x, y):
    x, y = x.double(), y.double(); den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)

dev = "cuda"
torch.manual_seed(0)
fails = []
def check(name, ok, extra=""):
    print(("OK  " if ok else "FAIL") + f" {name} {extra}", flush=True)
    if not ok: fails.append(name)

G, N, K = 4, 4096, 7168
counts = [300, 0, 129, 1000]
starts, psum, s = [], [], 0
for c in counts:
    starts.append(s); psum.append(s + c); s = -(-(s + c) // 128) * 128
M = s + 128  # rows past the last expert
x = torch.randn(M, K, device=dev).bfloat16()
mi = torch.full((M,), -1, dtype=torch.int32, device=dev)
for e, (st, c) in enumerate(zip(starts, counts)): mi[st:st + c] = e
x[mi < 0] = 0
psum_t = torch.tensor(psum, dtype=torch.int32, device=dev)
xq, xs = per_token_group_quant_fp8(x, tma_aligned_scales=True)
w = torch.randn(G, N, K, device=dev)
wq, ws = per_block_quant_fp8(w)
wd = dequant_block_fp8(wq, ws)
xd = dequant_fp8(xq, xs)
ref = torch.zeros(M, N, device=dev)
for e, (st, c) in enumerate(zip(starts, counts)):
    ref[st:st + c] = xd[st:st + c] @ wd[e].T
d1 = torch.full((M, N), 7.0, device=dev, dtype=torch.bfloat16); gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d1, mi)
d2 = torch.full_like(d1, 7.0); gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d2, psum_t, use_psum_layout=True)
d3 = torch.full_like(d1, 7.0); gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d3, psum_t, use_psum_layout=True, use_pdl=True)
check("contig m_indices calc_diff", calc_diff(d1, ref) < 1e-3, calc_diff(d1, ref))
check("psum == m_indices bitwise", torch.equal(d1.view(torch.int16), d2.view(torch.int16)))
check("psum PDL == psum", torch.equal(d3, d2))
check("padding zero", bool((d2[mi < 0] == 0).all()))
d4 = torch.full_like(d1, 7.0); gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d4, psum_t, use_psum_layout=True, ensure_zero_padding=False)
check("psum no zero pad leaves padding", bool((d4[mi < 0] == 7.0).all()) and torch.equal(d4[mi >= 0], d2[mi >= 0]))
gemm.set_num_sms(16)
d5 = torch.full_like(d1, 7.0); gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d5, psum_t, use_psum_layout=True)
gemm.set_num_sms(0)
check("num_sms=16 same bits", torch.equal(d5, d2), f"(device {gemm.get_num_sms()} SMs)")
# masked
T = 64
xm = torch.randn(G, T, K, device=dev).bfloat16(); xmq, xms = per_token_group_quant_fp8(xm, tma_aligned_scales=True)
mm = torch.tensor([5, 0, 64, 33], dtype=torch.int32, device=dev)
refm = torch.einsum("gtk,gnk->gtn", dequant_fp8(xmq, xms), wd)
for em in (8, 24, 48, 200):
    dm = torch.full((G, T, N), 7.0, device=dev, dtype=torch.bfloat16)
    gemm.fp8_m_grouped_gemm_nt_masked((xmq, xms), (wq, ws), dm, mm, em, use_pdl=True)
    ok = all(calc_diff(dm[e, :int(mm[e])], refm[e, :int(mm[e])]) < 1e-3 for e in range(G) if mm[e] > 0)
    ok = ok and all(bool((dm[e, int(mm[e]):] == 7.0).all()) for e in range(G))
    check(f"masked expected_m={em}", ok)
# dense fp8
for m in (16, 200, 4096):
    for n, k in ((7168, 2048), (2112, 7168)):
        a = torch.randn(m, k, device=dev).bfloat16(); aq, as_ = per_token_group_quant_fp8(a, tma_aligned_scales=True)
        bq, bs = per_block_quant_fp8(torch.randn(1, n, k, device=dev)); bq, bs = bq[0], bs[0]
        r = dequant_fp8(aq, as_) @ dequant_block_fp8(bq[None], bs[None])[0].T
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16); gemm.fp8_gemm_nt((aq, as_), (bq, bs), d)
        c = torch.randn(m, n, device=dev); d32 = torch.empty(m, n, device=dev); gemm.fp8_gemm_nt((aq, as_), (bq, bs), d32, c)
        dnn = torch.empty_like(d); gemm.fp8_gemm_nn((aq, as_), (bq.T.contiguous(), bs.T.contiguous()), dnn)
        check(f"fp8_gemm_nt M={m} N={n} K={k}", calc_diff(d, r) < 1e-3 and calc_diff(d32, r + c) < 1e-3 and calc_diff(dnn, r) < 1e-3,
              f"{calc_diff(d, r):.2e} {calc_diff(d32, r + c):.2e} {calc_diff(dnn, r):.2e}")
        ab, bb = a, torch.randn(n, k, device=dev).bfloat16()
        db = torch.empty(m, n, device=dev, dtype=torch.bfloat16); gemm.bf16_gemm_nt(ab, bb, db)
        check(f"bf16_gemm_nt M={m} N={n} K={k}", calc_diff(db, ab.float() @ bb.float().T) < 1e-5)
wb = torch.randn(G, N, K, device=dev).bfloat16()
refb = torch.zeros(M, N, device=dev)
for e, (st, c) in enumerate(zip(starts, counts)):
    refb[st:st + c] = x[st:st + c].float() @ wb[e].float().T
db1 = torch.full((M, N), 7.0, device=dev, dtype=torch.bfloat16); gemm.m_grouped_bf16_gemm_nt_contiguous(x, wb, db1, psum_t, use_psum_layout=True)
check("bf16 grouped psum", calc_diff(db1, refb) < 1e-5 and bool((db1[mi < 0] == 0).all()), calc_diff(db1, refb))
dbm = torch.full((G, T, N), 7.0, device=dev, dtype=torch.bfloat16); gemm.m_grouped_bf16_gemm_nt_masked(xm, wb, dbm, mm, 32)
refbm = torch.einsum("gtk,gnk->gtn", xm.float(), wb.float())
check("bf16 masked", all(calc_diff(dbm[e, :int(mm[e])], refbm[e, :int(mm[e])]) < 1e-5 for e in range(G) if mm[e] > 0))
print("FAILS:", fails)
sys.exit(1 if fails else 0)
