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


def test_submodules_resolve_to_the_one_module(tmp_path):
    # a fresh interpreter, so sys.modules shows every module the imports executed
    code = textwrap.dedent("""
        import sys, moe_ep, moe_ep.alias
        moe_ep.alias.install()
        import deep_ep.buffer, deep_ep.events, deep_ep.backends.base
        from deep_ep.utils import EventHandle, EventOverlap
        from deep_ep import Buffer, Config
        import deep_gemm.utils.math, deep_gemm.utils.layout
        from deep_gemm.utils import ceil_div, align, per_token_cast_to_fp8, per_block_cast_to_fp8, calc_diff
        from deep_gemm.utils.math import per_token_cast_to_fp8 as ptc
        from deep_gemm import (gemm_fp8_fp8_bf16_nt, get_col_major_tma_aligned_tensor,
                               m_grouped_gemm_fp8_fp8_bf16_nt_contiguous, ceil_div as cd)
        from deep_ep import utils as ep_utils, buffer as ep_buffer
        from deep_gemm import utils as gemm_utils
        import moe_ep.deepep.v1.buffer, moe_ep.events, moe_ep.gemm.utils.math
        assert ep_utils is sys.modules["deep_ep.utils"] is moe_ep.events and ep_buffer is moe_ep.deepep.v1.buffer
        assert gemm_utils is sys.modules["deep_gemm.utils"] is moe_ep.gemm.utils and gemm_utils.ceil_div is ceil_div
        assert deep_ep.buffer is moe_ep.deepep.v1.buffer and deep_ep.buffer.Buffer is moe_ep.Buffer is Buffer
        assert sys.modules["deep_ep.utils"] is moe_ep.events and EventOverlap is moe_ep.EventOverlap
        assert deep_gemm.utils.math is moe_ep.gemm.utils.math and ptc is per_token_cast_to_fp8 and cd is ceil_div
        # nothing executed twice: every deep_* entry is a moe_ep module object (a second execution would be
        # named deep_*), and no class was defined twice
        for k in sys.modules:
            if k.startswith(("deep_ep.", "deep_gemm.")):
                assert sys.modules[k].__name__.startswith("moe_ep"), k
        assert ceil_div(7, 2) == 4 and align(5, 4) == 8
        import torch
        h = EventHandle()
        EventOverlap(h).current_stream_wait()
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_v1_grouped_name_takes_m_indices():
    import moe_ep.gemm as gemm
    from moe_ep.quant import per_block_quant_fp8, per_token_group_quant_fp8

    m, k = 128, 128
    xq, xs = per_token_group_quant_fp8(torch.randn(m, k).to(torch.bfloat16))
    wq, ws = per_block_quant_fp8(torch.randn(1, 128, k))
    d1 = torch.empty(m, 128, dtype=torch.bfloat16)
    d2 = torch.empty(m, 128, dtype=torch.bfloat16)
    idx = torch.zeros(m, dtype=torch.int32)
    gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs=(xq, xs), rhs=(wq, ws), out=d1, m_indices=idx)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d2, idx)
    assert torch.equal(d1, d2)
    d3 = torch.empty(m, 128, dtype=torch.bfloat16)
    gemm.gemm_fp8_fp8_bf16_nt((xq, xs), (wq[0], ws[0]), d3)
    assert torch.equal(d3, d2)
    assert gemm.get_col_major_tma_aligned_tensor is gemm.get_mn_major_tma_aligned_tensor


def test_runner_turns_the_interpreter_on_without_cuda(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text("import os\nprint(os.environ.get('TRITON_INTERPRET'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "moe_ep.alias", str(script)], capture_output=True, text=True,
                       timeout=120, env={**env, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0 and p.stdout.strip() == "1", (p.stdout, p.stderr)


def _env_backend_rank(rank: int, world: int) -> tuple:
    os.environ["MOE_EP_BACKEND"] = "symm"
    import moe_ep

    buf = moe_ep.Buffer(None, 0, moe_ep.Buffer.get_low_latency_rdma_size_hint(8, 128, world, 4), low_latency_mode=True)
    explicit = moe_ep.Buffer(None, 0, 0, backend="torch")  # an explicit backend= is not overridden
    eb = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2)  # DeepEP V2's face too
    return buf.backend_name, explicit.backend_name, eb.buffer.backend_name


def test_environment_variable_picks_the_backend():
    assert launch(_env_backend_rank, 2, timeout_s=120) == [("symm", "torch", "symm")] * 2
