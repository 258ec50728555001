"""The layout of codegen/ says what ships into a model dir and what only measures; imports flow one way.

- the patch path (codegen/patch, codegen/modeldir) and the policy (codegen/policy) never import the harness,
  the regression matrix or the CLI; the policy never imports the patch path; nothing imports the CLI;
- every entry point is a `python -m codegen` subcommand (codegen/__main__.py is the only `__main__`);
- the fingerprint in `.codegen/manifest.json` covers only what shapes a patched dir: editing the bench, the
  harness or an example shape leaves a patched dir up to date.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "codegen"

#: folder (or module) -> the codegen folders it may import, besides itself and the shared modules
SHARED = {"codegen", "codegen.errors", "codegen.families", "codegen.render", "codegen.ranks", "codegen.models",
          "codegen.versions", "codegen.rank_commands", "codegen.splice"}
#: shared modules a folder still may not import: the policy ships into model dirs and takes the family's layout as
#: plain data (the table imports the policy runtime's names, never the other way round)
FORBIDDEN = {"codegen.policy": {"codegen.families"}}
ALLOWED = {
    "codegen.policy": {"codegen.policy"},
    "codegen.modeldir": {"codegen.modeldir", "codegen.policy"},
    "codegen.patch": {"codegen.patch", "codegen.modeldir", "codegen.policy"},
    "codegen.harness": {"codegen.harness", "codegen.patch", "codegen.modeldir", "codegen.policy"},
    "codegen.regression": {"codegen.patch", "codegen.modeldir", "codegen.policy"},
    "codegen.serve": {"codegen.serve", "codegen.patch", "codegen.modeldir", "codegen.policy"},
}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every codegen module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("codegen")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("codegen"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _folder(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    module = _module_name(path)
    folder = _folder(module)
    allowed = ALLOWED.get(folder)
    if allowed is None:
        return  # the CLI, the package itself, the shared modules
    known = {_module_name(p) for p in MODULES}
    forbidden = FORBIDDEN.get(folder, set())
    wrong = sorted(m for m in _imports(path) if m in known and (_folder(m) in forbidden or m in forbidden or (
        m not in SHARED and _folder(m) not in allowed)))
    assert not wrong, f"{module} imports {wrong}, outside what {folder} may use ({sorted(allowed)})"


def test_nothing_imports_the_cli_and_the_only_main_is_the_package_entry_point():
    for path in MODULES:
        if path.name in ("cli.py", "__main__.py"):
            continue
        assert "codegen.cli" not in _imports(path), path
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert not mains, f"{path}: an entry point of its own; make it a `python -m codegen` subcommand"


def test_the_fingerprint_covers_what_shapes_a_patched_dir_only(monkeypatch):
    import dataclasses

    from codegen import families
    from codegen.patch import plan

    plan.generator_digest.cache_clear()
    before = plan.generator_digest()
    harness_files = [p for p in (PACKAGE / "harness").rglob("*.py")]
    covered = {p for root in plan.OUTPUT_CODE for p in ([root] if root.is_file() else root.rglob("*"))}
    assert harness_files and not covered & set(harness_files)
    assert PACKAGE / "patch" / "rewrite.py" in covered and PACKAGE / "policy" / "runtime" / "entry.py" in covered
    # an example shape, a bench label or a stock figure is not output: the digest stays; a layout field is: it moves
    examples = families.EXAMPLES["qwen2_moe"]
    monkeypatch.setitem(families.EXAMPLES, "qwen2_moe", dataclasses.replace(
        examples, tiny={**examples.tiny, "hidden_size": 128}, bench_label="x"))
    monkeypatch.setitem(families.STOCK_AUTOTP, "qwen2_moe", families.StockAutoTP(crash="x"))
    plan.generator_digest.cache_clear()
    assert plan.generator_digest() == before
    row = families.FAMILIES["qwen2_moe"]
    monkeypatch.setitem(families.FAMILIES, "qwen2_moe", dataclasses.replace(row, routers=("gate",)))
    plan.generator_digest.cache_clear()
    assert plan.generator_digest() != before
    plan.generator_digest.cache_clear()


def _marks(nodes) -> set[str]:
    """The `pytest.mark.<name>` names used in decorators or a `pytestmark = ...` value."""
    return {n.attr for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("test_*.py")), ids=lambda p: p.name)
def test_every_test_has_exactly_one_tier_marker(path):
    """The fast tier is chosen by name (`-m unit`): a test that starts a process must say so, or it would run there."""
    from conftest import TIERS

    tree = ast.parse(path.read_text())
    module = _marks(n.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets))
    wrong = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            tiers = sorted((module | _marks(node.decorator_list)) & set(TIERS))
            if len(tiers) != 1:
                wrong[node.name] = tiers
    assert not wrong, f"{path.name}: tests without exactly one tier marker of {TIERS}: {wrong}"
