"""Every name the README and the docs/ pages show as ``moe_ep.X`` / ``moe_ep.module.X`` / ``eplb.X`` / ``microbatch.X``
(prose and code blocks) and every ``from <package> import ...`` in their code blocks resolves where they say; the README
names no kernel as having run correctly on a GPU unless perf/RESULTS.md has a passing row for it."""

from __future__ import annotations

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "perf" / "RESULTS.md"
PACKAGES = ("moe_ep", "eplb", "microbatch")
DOTTED = re.compile(r"(?<![\w.])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+((?:%s)(?:\.\w+)*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))"
                         % "|".join(PACKAGES), re.M)


def _resolve(path: str):
    """The object at dotted ``path``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError names what the README promises but the package lacks
        return obj
    raise ModuleNotFoundError(path)


def _references(text: str) -> set:
    refs = {r for r in DOTTED.findall(text) if not r.endswith((".md", ".py"))}  # file names (docs/eplb.md) are not names
    for module, in_parens, on_line in FROM_IMPORT.findall(text):
        names = [n.split(" as ")[0].strip() for n in (in_parens or on_line).split(",")]
        refs.update(f"{module}.{n}" for n in names if n)
    return refs


def test_readme_names_resolve():
    refs = set()
    for page in [README, *DOCS]:
        refs |= _references(page.read_text())
    assert {"moe_ep.Buffer", "moe_ep.CallMismatchError", "moe_ep.RemoteRankError", "eplb.map_topk"} <= refs
    missing = []
    for ref in sorted(refs):
        try:
            _resolve(ref)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{ref}: {type(exc).__name__}: {exc}")
    assert not missing, "README / docs names that do not resolve:\n" + "\n".join(missing)


def test_reference_finder_sees_prose_code_and_from_imports():
    text = ("see `moe_ep.Foo.bar`. Also eplb.baz, not xmoe_ep.nope\n```python\nfrom moe_ep.quant import (a,\n b)\n"
            "import microbatch\nmicrobatch.run(x)\n```")
    assert _references(text) == {"moe_ep.Foo.bar", "eplb.baz", "moe_ep.quant", "moe_ep.quant.a", "moe_ep.quant.b",
                                 "microbatch.run"}


# ---------------------------------------------------------------------------------------------- GPU claims
# Kernels by the words that name them (README and perf/RESULTS.md spell them several ways).
KERNELS = {
    "mega moe": r"mega[ _-]?moe|fp8_mega_moe",
    "grouped gemm": r"grouped (fp8 |bf16 )?gemms?|gemm (contiguous|masked)|m_grouped",
    "quant": r"\bquant\b|quantization|per_token_group_quant",
    "low-latency dispatch/combine": r"low-latency|\bll\b",
    "normal-mode dispatch/combine": r"normal[- ]mode",
    "map_topk": r"map_topk",
}
GPU = re.compile(r"\b(H100|H200|H800|B200|on (a|the|one|that) GPU|on the device)\b", re.I)
RAN = re.compile(r"\b(ran|run correctly|correct(ly)?|passed|matched|bitwise|ok)\b", re.I)
NOT = re.compile(r"\b(not|never|failed|fails|FAILED|owed|yet)\b")


def _sentences(text: str) -> list[str]:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return [s.strip() for s in re.split(r"(?<=[.;])\s+|\n\s*\n|\n\|", text) if s.strip()]


def gpu_run_claims(text: str) -> set[str]:
    """Kernels a text says ran (correctly) on a GPU: in one sentence or table cell, a GPU, a word of success and
    the kernel's name, without a negation."""
    found = set()
    for sent in _sentences(text):
        if GPU.search(sent) and RAN.search(sent):
            for part in re.split(r"[,(]", sent):
                if NOT.search(part):
                    continue
                found |= {k for k, rx in KERNELS.items() if re.search(rx, part, re.I)}
    return found


def backed_by_results(text: str) -> set[str]:
    """Kernels a GPU entry of perf/RESULTS.md reports as ok: the passing part of a stage row (before "FAILED"),
    or a timing row of a GPU run (each checked against its reference)."""
    gpu_part = text[text.index("NVIDIA"):]
    gpu_part = gpu_part[: gpu_part.index("\n## ")] if "\n## " in gpu_part else gpu_part
    found = set()
    for line in gpu_part.splitlines():
        if not line.startswith("|"):
            continue
        ok = re.split(r"FAILED|TIMEOUT|not reached", line)[0]
        if re.search(r"\bok\b|\d+ passed|\bus\b", ok):
            found |= {k for k, rx in KERNELS.items() if re.search(rx, ok, re.I)}
    return found


def test_readme_gpu_claims_are_rows_of_results():
    backed = backed_by_results(RESULTS.read_text())
    assert {"quant", "grouped gemm", "low-latency dispatch/combine"} <= backed, backed
    assert "mega moe" in backed  # failed on 2026-11-27, passed on one rank on 2026-11-28 (RESULTS)
    claims = gpu_run_claims(README.read_text())
    assert {"quant", "grouped gemm"} <= claims, claims  # the finder sees the README's own claims
    assert claims <= backed, f"the README says these ran on a GPU, perf/RESULTS.md has no passing row: {claims - backed}"


def test_gpu_claim_finder_catches_an_unbacked_claim():
    old = ("| Triton, GPU (compiled kernels) | >= 3.6 | 3.6.0 on an H200 (quant, grouped GEMM, `symm` low-latency / "
           "normal, Mega MoE ran correctly); sm90 compile tests |")
    assert "mega moe" in gpu_run_claims(old)
    assert "mega moe" not in gpu_run_claims("Not correct on the GPU yet: Mega MoE (its check failed).")
    assert "mega moe" not in backed_by_results("## 2026, NVIDIA H200\n| kernels-small | 15/16 ok; FAILED: mega_moe | 69 |\n")
