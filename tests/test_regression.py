"""Regression matrix: pinned upstream modeling sources, rewritten as `patch` does, diffed against generated/.

The sources come from the pinned transformers wheels (downloaded into the cache by codegen.regression, never
committed) and from tests/fixtures/hub_deepseek; nothing here imports the installed transformers, so the
tests give the same answer under transformers 4.x and 5.x. Besides the exact comparison with generated/,
each entry is checked for the properties the rewrite promises, with `ast` and independently of the rewriter.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from codegen import regression as upstream
from codegen.errors import BadSource
from codegen.families import ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, \
    ANCHOR_ROUTED_STATEMENT, ANCHOR_SHARED_INPLACE_SUM, FAMILIES
from codegen.modeldir.directory import ModelDir
from codegen.modeldir.layout import POLICY_FILE as POLICY
from codegen.patch.plan import make_plan
from codegen.patch.rewrite import REDUCTION_COMMENT, ROUTED_REDUCTION_COMMENT, render_helper_block, rewrite_source
from codegen.policy.runtime.base import REDUCE_HELPER as HELPER
from codegen.regression import LATEST, MATRIX, RELEASES, REGENERATE, Entry

pytestmark = pytest.mark.regression

IDS = [e.id for e in MATRIX]
#: one pytest-xdist worker per entry (`--dist loadgroup`): its rewrite is computed once
ENTRIES = [pytest.param(e, id=e.id, marks=pytest.mark.xdist_group(e.id)) for e in MATRIX]


def _result(entry: Entry) -> upstream.Result:
    """The entry's fresh rewrite, computed once per session (upstream.build caches it)."""
    try:
        return upstream.build(entry)
    except upstream.FetchFailed as exc:
        pytest.fail(f"{entry.id}: {exc.message}", pytrace=False)
    except BadSource as exc:
        pytest.fail(f"{entry.id}: the pinned source no longer rewrites: {exc.message}", pytrace=False)


@functools.cache
def _committed() -> dict[str, str]:
    """generated/ as committed, read once per worker (the tests never write it)."""
    return upstream.committed_files()


@functools.lru_cache(maxsize=None)
def _trees(entry: Entry) -> tuple[ast.Module, ast.Module]:
    """(original, patched) of an entry, parsed once."""
    result = _result(entry)
    return ast.parse(result.original), ast.parse(result.patched)


def _stale(name: str, committed: str | None, fresh: str | None) -> str:
    return (
        f"{name} does not match a fresh rewrite (diff of diffs, - committed / + fresh):\n"
        f"{upstream.diff_of_diffs(name, committed, fresh)}\n"
        f"If the change is intended, run `{REGENERATE}` and review the diff of generated/."
    )


# ------------------------------------------------------------------------------------ exact comparison


@pytest.mark.parametrize("entry", ENTRIES)
def test_rewrite_matches_generated(entry: Entry) -> None:
    result = _result(entry)
    committed = _committed()
    stale = [
        _stale(name, committed.get(name), fresh) for name, fresh in result.files.items() if committed.get(name) != fresh
    ]
    row = upstream.index_row(result)
    if row not in committed.get(upstream.INDEX, "").splitlines():
        stale.append(f"{upstream.INDEX} lacks (or has a stale) row for {entry.id}: {row}\nRun `{REGENERATE}`.")
    if stale:
        pytest.fail("\n".join(stale), pytrace=False)


def test_generated_dir_holds_exactly_the_matrix() -> None:
    expected = upstream.expected_paths()
    committed = _committed()
    extra = sorted(set(committed) - expected)
    missing = sorted(expected - set(committed))
    if extra or missing:
        pytest.fail(f"generated/ has files no matrix entry produces {extra} or lacks {missing}: run `{REGENERATE}`",
                    pytrace=False)
    rows = [line for line in committed[upstream.INDEX].splitlines() if line.startswith("| ") and "|---" not in line]
    assert len(rows) == len(MATRIX) + 1, f"{upstream.INDEX}: {len(rows) - 1} rows for {len(MATRIX)} entries"


def test_generated_files_say_how_they_were_made() -> None:
    for name, text in _committed().items():
        head = text.splitlines()[0]
        assert "GENERATED" in head and REGENERATE in head, f"{name}: first line does not say it is generated"
        assert str(Path.home()) not in text and str(upstream.ROOT) not in text, f"{name}: machine-specific path"


def _installed_transformers() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


#: the sources `patch` resolves in this environment: the installed release's, and remote code shipped in a dir
#: (each environment of scripts/test.sh runs its own; the other releases are covered by the pinned-wheel tests)
RESOLVABLE = [e for e in MATRIX if e.release in (None, _installed_transformers())]


def test_this_environment_resolves_a_pinned_release() -> None:
    assert any(e.release is not None for e in RESOLVABLE), f"transformers {_installed_transformers()} is not pinned"


@pytest.mark.parametrize("entry", RESOLVABLE, ids=[e.id for e in RESOLVABLE])
def test_patch_writes_what_generated_expects(entry: Entry, tmp_path: Path) -> None:
    """`make_plan` (what `patch` writes) agrees with upstream.build for the sources this environment resolves."""
    family = FAMILIES[entry.family]
    config = {"model_type": family.model_type, family.num_experts_keys[0]: 4}
    if entry.release is None:  # remote code shipped in the dir, next to its shipped modules
        source = upstream.ROOT / entry.path
        config["auto_map"] = {"AutoModelForCausalLM": f"{source.stem}.{family.auto_classes['AutoModelForCausalLM']}"}
        for path in [source, *(source.with_name(f"{module}.py") for module in entry.shipped_modules)]:
            shutil.copy(path, tmp_path / path.name)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    result = _result(entry)
    plan = make_plan(ModelDir(tmp_path), None, coalesce=True)
    own = result.original if result.wrapper is None else result.wrapper_original
    assert plan.source.text == own, f"patch resolved another source than {entry.path}"
    if result.wrapper is None:
        assert plan.files[entry.output_name].decode("utf-8") == result.patched
    else:  # the wrapper's module builds the text decoder from the patched text module written beside it
        assert plan.inputs.text_source is not None and plan.inputs.text_source.text == result.original
        assert plan.files[entry.output_name].decode("utf-8") == result.wrapper.code
        assert plan.files[plan.inputs.text_source.output_name].decode("utf-8") == result.patched
    policy = result.files[upstream.repo_path(entry.policy_path)]
    assert policy.endswith(plan.files[POLICY].decode("utf-8")) and policy.startswith("# GENERATED")


# ------------------------------------------------------------------------------------ matrix coverage


def test_matrix_covers_the_first_pinned_release_of_every_family_and_the_latest() -> None:
    """Every release a family's matrix names ships its modeling file; no pinned release before the first of them
    does (the first is the family's first release); the latest pinned release is covered."""
    covered = {(e.family, e.release) for e in MATRIX if e.release}
    latest = LATEST
    for family in FAMILIES.values():
        path = family.builtin_module.replace(".", "/") + ".py"
        ships = {}
        for release in RELEASES:
            try:
                ships[release] = path in upstream.wheel_members(release)
            except upstream.FetchFailed as exc:
                pytest.fail(exc.message, pytrace=False)
        named = [r for r in RELEASES if (family.model_type, r) in covered]
        assert named and all(ships[r] for r in named), f"{family.model_type}: {named} do not all ship {path}"
        first = min(named, key=lambda v: tuple(int(p) for p in v.split(".")))
        assert first == family.first_release and (family.model_type, latest) in covered
        earlier = [r for r in RELEASES if ships[r] and tuple(map(int, r.split("."))) < tuple(map(int, first.split(".")))]
        assert not earlier, f"transformers {earlier} already ship {family.builtin_module}: fix known_good"


def test_known_good_releases_are_the_matrix() -> None:
    """The releases error messages call known to work are the ones this matrix proves."""
    for family in FAMILIES.values():
        quoted = {v for v in family.known_good if v[0].isdigit()}
        assert quoted == {e.release for e in MATRIX if e.family == family.model_type and e.release}


# ------------------------------------------------------------------------------------ properties


def _class(tree: ast.Module, names) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names]
    assert len(found) == 1, f"expected one of {names} at module level, found {[c.name for c in found]}"
    return found[0]


def _helper_calls(tree: ast.AST) -> list[ast.Call]:
    calls = (n for n in ast.walk(tree) if isinstance(n, ast.Call))
    return [n for n in calls if isinstance(n.func, ast.Name) and n.func.id == HELPER]


def _is_sum_into(node: ast.AST, var: str, source: str) -> bool:
    """`var = a + b` or `var += b`, where the expression involves a shared expert output."""
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add):
        into = len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == var
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        into = isinstance(node.target, ast.Name) and node.target.id == var
    else:
        return False
    return into and "shared" in (ast.get_source_segment(source, node) or "")


def _expert_helpers(moe: ast.ClassDef, experts: str) -> set[str]:
    """Methods of the MoE block besides `forward` that reach `self.<experts>` (4.x LongCat's `self.moe(...)`)."""
    return {n.name for n in moe.body if isinstance(n, ast.FunctionDef) and n.name != "forward" and any(
        isinstance(a, ast.Attribute) and a.attr == experts and ast.unparse(a.value) == "self" for a in ast.walk(n))}


def _completes_routed_output(node: ast.stmt, var: str, experts: str, helpers: set[str] = frozenset()) -> bool:
    """`var = ...self.<experts>(...)...` (or a call of a block method that runs them: `helpers`), or a loop over the
    experts accumulating into `var` in place."""
    def calls_experts(tree: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in {experts, *helpers}
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "self" for n in ast.walk(tree)
        )

    if isinstance(node, ast.Assign):
        return [ast.unparse(t) for t in node.targets] == [var] and calls_experts(node.value)
    if isinstance(node, (ast.For, ast.While)):
        mentions = any(isinstance(n, ast.Attribute) and n.attr == experts for n in ast.walk(node))
        accumulates = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "index_add_"
            and ast.unparse(n.func.value) == var for n in ast.walk(node)
        )
        return mentions and accumulates
    return False


@pytest.mark.parametrize("entry", ENTRIES)
def test_patched_source_compiles_and_reduces_once_after_the_sum(entry: Entry) -> None:
    """Exactly one reduction, where the family's anchor kind says: after the sum, or after the routed output."""
    result = _result(entry)
    family = FAMILIES[entry.family]
    patched = result.patched
    compile(patched, entry.output_name, "exec")
    tree = _trees(entry)[1]

    calls = _helper_calls(tree)
    assert len(calls) == 1, f"{len(calls)} calls of {HELPER} in {entry.id}, expected exactly one"
    call = calls[0]
    assert len(call.args) == 2 and isinstance(call.args[0], ast.Name) and call.args[0].id == "self"

    moe = _class(tree, family.moe_classes)
    forward = [n for n in moe.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    assert len(forward) == 1
    body = forward[0].body
    index = [i for i, stmt in enumerate(body) if call in ast.walk(stmt)]
    assert index, f"the reduction is not in {moe.name}.forward"
    i = index[0]
    reduction = body[i]
    if family.anchor == ANCHOR_RETURNED_SUM:  # `return _codegen_moe_all_reduce(self, routed + shared)`, last
        assert isinstance(reduction, ast.Return) and i == len(body) - 1
        assert isinstance(call.args[1], ast.BinOp) and isinstance(call.args[1].op, ast.Add)
        assert patched.splitlines()[reduction.lineno - 2].strip() == REDUCTION_COMMENT
        return
    if family.anchor == ANCHOR_RETURNED_ROUTED:  # `return _codegen_moe_all_reduce(self, self.experts(...)...)`
        assert isinstance(reduction, ast.Return) and i == len(body) - 1
        # the experts are called in the reduced value, or it names what carries their output (`out = self.experts(..)`,
        # `out = zeros.index_add(0, idx, out)`)
        experts = {f"self.{attr}" for attr in family.expert_modules}
        carriers: set[str] = set()
        assigns = [n for n in ast.walk(forward[0]) if isinstance(n, ast.Assign) and len(n.targets) == 1
                   and isinstance(n.targets[0], ast.Name)]
        for _ in assigns:
            carriers |= {a.targets[0].id for a in assigns if any(
                (isinstance(n, ast.Call) and ast.unparse(n.func) in experts)
                or (isinstance(n, ast.Name) and n.id in carriers) for n in ast.walk(a.value))}
        assert any((isinstance(n, ast.Call) and ast.unparse(n.func) in experts)
                   or (isinstance(n, ast.Name) and n.id in carriers) for n in ast.walk(call.args[1]))
        assert patched.splitlines()[reduction.lineno - 2].strip() == ROUTED_REDUCTION_COMMENT
        return
    if family.anchor == ANCHOR_ROUTED_STATEMENT:  # at any depth: the block that holds the reduction
        body = next(block for node in ast.walk(forward[0]) for block in (getattr(node, "body", None),)
                    if isinstance(block, list) and any(isinstance(st, ast.Assign) and st.value is call for st in block))
        i = next(j for j, st in enumerate(body) if isinstance(st, ast.Assign) and st.value is call)
        reduction = body[i]
    assert isinstance(reduction, ast.Assign) and reduction.value is call, "the reduction is not its own statement"
    var = reduction.targets[0].id
    assert isinstance(call.args[1], ast.Name) and call.args[1].id == var, "the reduction must rebind its input"
    if family.anchor == ANCHOR_ROUTED_STATEMENT:  # `var = ...self.<experts>(...)`, right before it
        before = body[i - 1] if i > 0 else None
        assert isinstance(before, ast.Assign) and ast.unparse(before.targets[0]) == var and any(
            isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{family.experts_attr}" for n in ast.walk(before))
        comment = ROUTED_REDUCTION_COMMENT
    elif family.anchor == ANCHOR_SHARED_INPLACE_SUM:  # `var.add_(routed)` (4.51: `var.scatter_add_(...)`)
        before = body[i - 1] if i > 0 else None
        assert isinstance(before, ast.Expr) and isinstance(before.value, ast.Call) and isinstance(
            before.value.func, ast.Attribute) and ast.unparse(before.value.func.value) == var \
            and before.value.func.attr in ("add_", "scatter_add_", "index_add_")
        comment = REDUCTION_COMMENT
    elif family.anchor == ANCHOR_ROUTED_FINAL:
        helpers = _expert_helpers(moe, family.experts_attr)
        assert i > 0 and _completes_routed_output(body[i - 1], var, family.experts_attr, helpers), (
            f"the statement before the reduction in {moe.name}.forward does not complete the routed output {var}:\n"
            + (ast.get_source_segment(patched, body[i - 1]) or "")
        )
        comment = ROUTED_REDUCTION_COMMENT
    else:
        assert i > 0 and any(_is_sum_into(n, var, patched) for n in ast.walk(body[i - 1])), (
            f"the statement before the reduction in {moe.name}.forward is not the routed + shared sum into {var}:\n"
            + (ast.get_source_segment(patched, body[i - 1]) or "")
        )
        comment = REDUCTION_COMMENT
    # the only line between the anchor statement and the reduction is codegen's comment
    sum_end = body[i - 1].end_lineno
    between = patched.splitlines()[sum_end : reduction.lineno - 1]
    assert [ln.strip() for ln in between] == [comment]
    assert result.rewrite.reduced_variable == var


@pytest.mark.parametrize("entry", ENTRIES)
def test_relative_imports_made_absolute_except_shipped(entry: Entry) -> None:
    result = _result(entry)
    original, patched = _trees(entry)
    before = [n for n in ast.walk(original) if isinstance(n, ast.ImportFrom) and n.level]
    after = [n for n in ast.walk(patched) if isinstance(n, ast.ImportFrom)]
    left = [n for n in after if n.level]
    for node in left:
        assert node.level == 1 and (node.module or "").split(".")[0] in entry.shipped_modules, (
            f"relative import left in {entry.id} at line {node.lineno}: from {'.' * node.level}{node.module or ''}"
        )
    assert {n.module for n in left} == {n.module for n in before if n.level == 1 and n.module in entry.shipped_modules}
    if entry.release is None:
        return
    # every relative import of the wheel's file now names a module the same wheel ships
    assert len(result.rewrite.absolutized_imports) == len(before) > 0
    members = upstream.wheel_members(entry.release)
    for module in result.rewrite.absolutized_imports:
        path = module.replace(".", "/")
        assert f"{path}.py" in members or f"{path}/__init__.py" in members, f"{entry.id}: no module {module}"


def _major(entry: Entry) -> int | None:
    return int(entry.release.split(".")[0]) if entry.release else None


def _defines_fused_layout(tree: ast.Module, family) -> bool:
    """Independently of the rewriter: the class the MoE block builds as its experts (one module down per step of an
    expert set's path, `text_moe.experts`) assigns every Parameter of the family's fused layout, for every set."""
    classes = {cls.name: cls for cls in tree.body if isinstance(cls, ast.ClassDef)}

    def built(holder: ast.ClassDef, attr: str) -> set[str]:
        return {
            n.value.func.id for n in ast.walk(holder)
            if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [f"self.{attr}"]
            and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
        }

    def fused(cls: ast.ClassDef) -> bool:
        params = {
            t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and ast.unparse(n.value.func).endswith("Parameter") for t in n.targets if isinstance(t, ast.Attribute)
        }
        return set(family.fused.parameters) <= params

    for path in family.expert_paths():
        holders = [_class(tree, family.moe_classes)]
        for step in path.split("."):
            holders = [classes[name] for holder in holders for name in built(holder, step) if name in classes]
        if not any(fused(cls) for cls in holders):
            return False
    return True


@pytest.mark.parametrize("entry", ENTRIES)
def test_native_loading_declared_for_fused_experts_only(entry: Entry) -> None:
    """Fused sources get the declaration (gpt_oss fuses its experts in 4.x too, where the method is inert: 4.x
    never calls `is_custom_code`); per-expert sources must not (nearly every 5.x source fuses; afmoe's first
    release, 5.0.0, still holds a ModuleList of MLPs, which the checkpoint stores as is)."""
    result = _result(entry)
    original, tree = _trees(entry)
    family = FAMILIES[entry.family]
    fused = _defines_fused_layout(original, family)
    assert fused == result.rewrite.fused_experts
    # a layout one module down (DBRX's `mlp.w1`: flat 2-D, stored in checkpoints as the module holds it) has no
    # checkpoint conversion to keep: it is not declared
    one_module_down = any("." in p for p in family.fused.parameters)
    if _major(entry) is not None and _major(entry) >= 5 and entry.release == LATEST and not one_module_down:
        assert fused, f"{entry.id}: the latest transformers without the family's fused layout"
    bases = [
        c for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name.endswith(family.pretrained_class_suffix)
        and any(isinstance(b, ast.Name) and b.id == "PreTrainedModel" for b in c.bases)
    ]
    # one per family, or one per model of a wrapper whose models have bases of their own (Qwen3-Omni's talker)
    assert bases, f"{entry.id}: no *PreTrainedModel base class"
    methods = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "is_custom_code"]
    if fused:
        own = [[n for n in base.body if isinstance(n, ast.FunctionDef) and n.name == "is_custom_code"]
               for base in bases]
        assert all(len(o) == 1 for o in own) and sorted(m.lineno for m in methods) == sorted(
            o[0].lineno for o in own), f"{entry.id}: is_custom_code must be on {[b.name for b in bases]} only"
        for (method,) in own:
            assert [ast.unparse(d) for d in method.decorator_list] == ["classmethod"]
            returns = [n for n in ast.walk(method) if isinstance(n, ast.Return)]
            assert len(returns) == 1 and isinstance(returns[0].value, ast.Constant) and returns[0].value.value is False
    else:
        assert not methods, f"{entry.id}: a per-expert source must not get is_custom_code"


@pytest.mark.parametrize("entry", ENTRIES)
def test_rewriting_a_patched_source_is_refused(entry: Entry) -> None:
    result = _result(entry)
    block = render_helper_block(FAMILIES[entry.family])
    with pytest.raises(BadSource, match=re.escape("already patched by codegen")):
        rewrite_source(result.patched, upstream.target_of(entry), block)


# ------------------------------------------------------------------------------------ fetching


def test_download_failure_is_one_clear_line(tmp_path, monkeypatch) -> None:
    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "transformers==5.24.0" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\nERROR: No network\n")

    (tmp_path / upstream.wheel_name("5.24.0")).write_bytes(b"not the pinned wheel")
    monkeypatch.setattr(upstream.subprocess, "run", failing_pip)
    with pytest.raises(upstream.FetchFailed) as info:
        upstream.fetch_wheel("5.24.0", tmp_path)
    message = info.value.message
    assert "\n" not in message
    assert "transformers==5.24.0" in message and "No network" in message and "CODEGEN_UPSTREAM_CACHE" in message
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".download-")], "temporary download dir left behind"


def test_cache_dir_default_and_override(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CODEGEN_UPSTREAM_CACHE", str(tmp_path))
    assert upstream.cache_dir() == tmp_path
    monkeypatch.delenv("CODEGEN_UPSTREAM_CACHE")
    assert upstream.cache_dir() == Path.home() / ".cache" / "codegen" / "upstream"


def test_every_table_key_is_a_model_type_transformers_writes() -> None:
    """The table is looked up by a config.json's `model_type` (normalised): a key spelled by its folder name
    (`inkling` for `inkling_mm_model`) would never match, and the refusal would lose its reason."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from codegen import support

    if int(transformers.__version__.split(".")[0]) < 5:  # the 4.x mapping lacks the 2025-26 families
        assert "qwen3_moe" in CONFIG_MAPPING_NAMES
        return
    known = {name.lower().replace("-", "_") for name in CONFIG_MAPPING_NAMES}
    unknown = [name for name in (*FAMILIES, *support.UNSUPPORTED) if name not in known]  # aliases: hub-only types
    assert unknown == [], unknown
