"""The modules that moved into folders (moe_ep/_paths.py) keep their old import paths: the old name is the module at
its new path, the same object, imported lazily; the table names every module that moved, and nothing else."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import moe_ep
from moe_ep._paths import MOVED

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "moe_ep"


def _module_files() -> set:
    """Every module of the package as a dotted name, computed from the tree."""
    names = set()
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        names.add(mod)
    return names


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_path_is_the_new_module(old, new):
    mod = importlib.import_module(old)
    assert sys.modules[old] is sys.modules[new] is mod
    assert mod.__name__ == new and mod.__spec__.name == new  # the module still names its own path
    parent, _, leaf = old.rpartition(".")
    assert getattr(sys.modules[parent], leaf) is mod


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_path_has_no_file_and_new_path_has_one(old, new):
    files = _module_files()
    assert old not in files, f"{old} has a file of its own again: drop it from the table or the file"
    assert new in files


def test_the_table_covers_every_module_that_moved():
    """The modules that moved are those of the folders the move made (deepep/, layer/, nvshmem/'s submodules) and
    gemm/mega_moe.py: each has an old name in the table, and each old name is a top-level module of the package."""
    folders = ("moe_ep.deepep.v1.", "moe_ep.deepep.v2.", "moe_ep.layer.", "moe_ep.nvshmem.")
    moved = {m for m in _module_files() if m.startswith(folders) or m == "moe_ep.gemm.mega_moe"}
    assert moved == set(MOVED.values())
    assert all(old.count(".") == 1 for old in MOVED)


def test_from_imports_and_attributes_through_the_old_paths():
    from moe_ep.buffer import Buffer
    from moe_ep.elastic import ElasticBuffer
    from moe_ep.elastic_memory import prefill_memory_rows
    from moe_ep.experts import masked_experts

    assert Buffer is moe_ep.Buffer and ElasticBuffer is moe_ep.ElasticBuffer
    assert prefill_memory_rows is moe_ep.deepep.v2.memory.prefill_memory_rows
    assert moe_ep.experts.masked_experts is masked_experts is moe_ep.layer.experts.masked_experts


def test_monkeypatch_through_either_path_patches_the_one_module(monkeypatch):
    import moe_ep.deepep.v2.expand as new

    monkeypatch.setattr("moe_ep.elastic_expand.USE_KERNELS", "patched")
    assert new.USE_KERNELS == "patched"
    monkeypatch.setattr(new, "USE_KERNELS", "again")
    assert moe_ep.elastic_expand.USE_KERNELS == "again"


def test_old_paths_import_lazily():
    """``import moe_ep`` imports none of the modules behind the old names it does not need (no NVSHMEM heap, no
    layer, no mega-MoE); an old name imports its module when it is named, as an import or as an attribute."""
    code = ("import sys, moe_ep\n"
            "lazy = ['moe_ep.nvshmem', 'moe_ep.nvshmem.heap', 'moe_ep.layer.moe', 'moe_ep.gemm.mega_moe',\n"
            "        'moe_ep.deepep.v2.buffer', 'moe_ep.deepep.v2.memory']\n"
            "assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]\n"
            "import moe_ep.nvshmem_heap\n"
            "assert sys.modules['moe_ep.nvshmem_heap'] is sys.modules['moe_ep.nvshmem.heap']\n"
            "assert moe_ep.elastic_memory is sys.modules['moe_ep.deepep.v2.memory']\n"
            "assert 'moe_ep.layer.moe' not in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr


def test_unknown_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("moe_ep.no_such_module")
    with pytest.raises(AttributeError):
        moe_ep.no_such_module  # noqa: B018


def test_in_repo_code_names_no_old_path():
    """Outside the table and this file, the code imports the new paths (a relative import of an old name, or an
    absolute one, would keep working but hide where the module lives)."""
    old_leaves = {old.split(".", 1)[1] for old in MOVED}
    bad = []
    for top in ("moe_ep", "eplb", "microbatch", "serving", "perf", "scripts", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name in ("_paths.py", "test_import_paths.py"):
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    mod = node.module or ""
                    if node.level == 0 and mod in MOVED:
                        bad.append(f"{path}:{node.lineno}")
                    if node.level == 0 and mod == "moe_ep" and {a.name for a in node.names} & old_leaves:
                        bad.append(f"{path}:{node.lineno}")
                    if node.level:  # resolved against the file's package, as the import system does
                        here = ".".join(path.relative_to(ROOT).parts[:-1]).split(".")
                        base = ".".join(here[:len(here) - node.level + 1] + ([mod] if mod else []))
                        if base in MOVED or {f"{base}.{a.name}" for a in node.names} & set(MOVED):
                            bad.append(f"{path}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    bad += [f"{path}:{node.lineno}" for a in node.names if a.name in MOVED]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                        old in node.value.split() or f"{old}." in node.value or f'"{old}"' in node.value
                        for old in MOVED):
                    bad.append(f"{path}:{node.lineno}")
    assert not bad, bad
