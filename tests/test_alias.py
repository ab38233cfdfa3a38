"""moe_ep.alias: after install(), ``import deep_ep`` / ``import deep_gemm`` are moe-ep's faces; an engine's calls
(a DeepEP normal dispatch + combine, a DeepGEMM grouped GEMM) run through those names; a real package of the
same name is never shadowed unless forced."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from moe_ep.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine_rank(rank: int, world: int) -> bool:
    import moe_ep.alias

    assert moe_ep.alias.install() == {"deep_ep": "moe_ep", "deep_gemm": "moe_ep.gemm"}
    import deep_ep
    import deep_gemm
    from deep_gemm.utils.layout import get_mn_major_tma_aligned_tensor  # noqa: F401 - where engines import it from
    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_combine, ref_dispatch

    E, k, hidden = 4 * world, 2, 256
    inputs = make_all_inputs(world, [6, 3][:world], hidden, E, k, seed=5)
    me = inputs[rank]
    buf = deep_ep.Buffer(None, num_nvl_bytes=0, num_rdma_bytes=0)
    with torch.inference_mode():
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            me.x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=me.topk_idx, topk_weights=me.topk_weights)
        ex_x, _, _, ex_w, ex_counts = ref_dispatch(rank, [i.x for i in inputs], [i.topk_idx for i in inputs],
                                                   [i.topk_weights for i in inputs], E)
        assert torch.equal(recv_x, ex_x) and torch.equal(recv_w, ex_w) and counts == ex_counts
        y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
        combined, _, _ = buf.combine(y, handle, topk_weights=recv_w)
        xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        refs = [ref_dispatch(r, xs, idxs, ws, E) for r in range(world)]
        ys = [(refs[r][0].float() * (r + 1)).to(torch.bfloat16) for r in range(world)]
        want, _ = ref_combine(rank, ys, idxs, E, [r[3] for r in refs])
        assert torch.equal(combined, want)
    # the expert GEMM through DeepGEMM's name: one expert, rows padded to the alignment
    from moe_ep.quant import per_block_quant_fp8, per_token_group_quant_fp8

    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    m = align
    xq, xs = per_token_group_quant_fp8(torch.randn(m, hidden).to(torch.bfloat16))
    wq, ws = per_block_quant_fp8(torch.randn(1, 128, hidden))
    d = torch.empty(m, 128, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, torch.zeros(m, dtype=torch.int32))
    assert bool(d.isfinite().all())
    return combined.shape == (me.x.shape[0], hidden)


def test_engine_code_runs_through_the_aliases():
    assert launch(_engine_rank, 2, timeout_s=120) == [True, True]


def test_a_real_package_is_never_shadowed(tmp_path):
    (tmp_path / "deep_gemm").mkdir()
    (tmp_path / "deep_gemm" / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent("""
        import warnings, moe_ep.alias
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = moe_ep.alias.install()
        import deep_gemm, deep_ep
        assert getattr(deep_gemm, "REAL", False), deep_gemm
        assert out["deep_gemm"].startswith("real package at") and out["deep_ep"] == "moe_ep", out
        assert any("real 'deep_gemm' is installed" in str(x.message) for x in w)
        forced = moe_ep.alias.install(["deep_gemm"], force=True)
        import sys
        assert forced == {"deep_gemm": "moe_ep.gemm"} and sys.modules["deep_gemm"].__name__ == "moe_ep.gemm"
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_runner_installs_the_named_aliases_before_the_script(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text("import sys, deep_ep\nprint(deep_ep.__name__, 'deep_gemm' in sys.modules, sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-m", "moe_ep.alias", str(script), "--tp", "8"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "MOE_EP_ALIAS": "deep_ep", "PYTHONPATH": ROOT})
    assert p.returncode == 0 and p.stdout.split() == ["moe_ep", "False", "['--tp',", "'8']"], (p.stdout, p.stderr)
