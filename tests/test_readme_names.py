"""Every name the README shows as ``moe_ep.X`` / ``moe_ep.module.X`` / ``eplb.X`` / ``microbatch.X`` (prose and code
blocks) and every ``from <package> import ...`` in its code blocks resolves where the README says."""

from __future__ import annotations

import importlib
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
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
    refs = set(DOTTED.findall(text))
    for module, in_parens, on_line in FROM_IMPORT.findall(text):
        names = [n.split(" as ")[0].strip() for n in (in_parens or on_line).split(",")]
        refs.update(f"{module}.{n}" for n in names if n)
    return refs


def test_readme_names_resolve():
    refs = _references(README.read_text())
    assert {"moe_ep.Buffer", "moe_ep.CallMismatchError", "moe_ep.RemoteRankError", "eplb.map_topk"} <= refs
    missing = []
    for ref in sorted(refs):
        try:
            _resolve(ref)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{ref}: {type(exc).__name__}: {exc}")
    assert not missing, "README names that do not resolve:\n" + "\n".join(missing)


def test_reference_finder_sees_prose_code_and_from_imports():
    text = ("see `moe_ep.Foo.bar`. Also eplb.baz, not xmoe_ep.nope\n```python\nfrom moe_ep.quant import (a,\n b)\n"
            "import microbatch\nmicrobatch.run(x)\n```")
    assert _references(text) == {"moe_ep.Foo.bar", "eplb.baz", "moe_ep.quant", "moe_ep.quant.a", "moe_ep.quant.b",
                                 "microbatch.run"}
